# The package's public names, each once: type checkers read them here, and __init__.py imports each on first use.
from .build import ReplayRows as ReplayRows
from .build import UnsupportedOperatorError as UnsupportedOperatorError
from .build import export_model as export_model
from .learner_export import ARTIFACT_FILES as ARTIFACT_FILES
from .learner_export import export as export
from .runtime import OrtOnlineLearner as OrtOnlineLearner
from .step_costs import measure_step_costs as measure_step_costs

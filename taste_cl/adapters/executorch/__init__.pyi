# The package's public names, each once: type checkers read them here, and __init__.py imports each on first use.
from .build import BACKEND as BACKEND
from .build import UnsupportedModelError as UnsupportedModelError
from .build import export as export
from .build import export_model as export_model
from .engine import ExecuTorchEngine as ExecuTorchEngine
from .engine_export import export_engine as export_engine
from .learner import EtOnlineLearner as EtOnlineLearner

# The package's public names, each once: type checkers read them here, and __init__.py imports each on first use.
from .artifacts import MANIFEST_FILE as MANIFEST_FILE
from .artifacts import ArtifactError as ArtifactError
from .artifacts import ExportError as ExportError
from .artifacts import read_manifest as read_manifest
from .backends import AUTO_ORDER as AUTO_ORDER
from .backends import BACKENDS as BACKENDS
from .backends import export as export
from .loader import load_learner as load_learner
from .parity import ParityError as ParityError
from .parity import ParityReport as ParityReport
from .parity import TrainingDivergesError as TrainingDivergesError
from .parity import UnstableTrainingError as UnstableTrainingError
from .tuning import DeviceBatchTuner as DeviceBatchTuner

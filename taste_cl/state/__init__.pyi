# The package's public names, each once: type checkers read them here, and __init__.py imports each on first use.
from .checkpoint import CHECKPOINT_FILE as CHECKPOINT_FILE
from .checkpoint import CheckpointLimits as CheckpointLimits
from .checkpoint import decode_state as decode_state
from .checkpoint import encode_state as encode_state
from .checkpoint import read_checkpoint as read_checkpoint
from .checkpoint import write_checkpoint as write_checkpoint
from .files import atomic_write_bytes as atomic_write_bytes

# The package's public names, each once: type checkers read them here, and __init__.py imports each on first use.
from .buffers import ClassBalancedReplay as ClassBalancedReplay
from .buffers import ReplayStrategy as ReplayStrategy
from .buffers import ReservoirReplay as ReservoirReplay
from .buffers import SeededStrategy as SeededStrategy
from .storage import BufferStorage as BufferStorage
from .storage import State as State

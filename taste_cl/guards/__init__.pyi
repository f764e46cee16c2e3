# The package's public names, each once: type checkers read them here, and __init__.py imports each on first use.
from .device import DeviceUpdateGuard as DeviceUpdateGuard
from .probe import ProbeGuard as ProbeGuard
from .size_rule import StepSizeHistory as StepSizeHistory
from .update import GUARD_MODES as GUARD_MODES
from .update import UpdateGuard as UpdateGuard

# The package's public names, each once: type checkers read them here, and __init__.py imports each on first use.
from .fleet import AdjustedUpdate as AdjustedUpdate
from .fleet import AggregationPolicy as AggregationPolicy
from .fleet import DroppedUpdate as DroppedUpdate
from .fleet import FleetResult as FleetResult
from .fleet import InvalidUpdateError as InvalidUpdateError
from .fleet import RoundStats as RoundStats
from .fleet import ValidatingStrategy as ValidatingStrategy
from .fleet import apply_policy as apply_policy
from .fleet import check_update as check_update
from .fleet import load_shared as load_shared
from .fleet import make_client_app as make_client_app
from .fleet import require_flwr as require_flwr
from .fleet import run_fleet_simulation as run_fleet_simulation
from .fleet import shared_state as shared_state

"""Fleet personalization on Flower: devices share what generalizes, keep what is personal.

- :mod:`.fleet`: shared/personal state, the ClientApp, the validating aggregation, the simulation;
- :mod:`.app`: the digits fleet as one Flower App (the same apps for simulation and deployment);
- :mod:`.secagg`: the fleet under SecAgg+ secure aggregation;
- :mod:`.deployment`: a real SuperLink and SuperNodes as processes on loopback;
- :mod:`.tls`: the run's TLS certificates and SuperNode authentication keys;
- :mod:`.updates`: what travels (the shared/personal split, update checks), numpy only;
- :mod:`.device_client`, :mod:`.device_data`, :mod:`.device_server`: devices that train
  the exported artifacts without torch (the ClientApp, its data, the server's export).
"""

from taste_cl._lazy import lazy_getattr

__all__ = [
    "AdjustedUpdate",
    "AggregationPolicy",
    "DroppedUpdate",
    "FleetResult",
    "InvalidUpdateError",
    "RoundStats",
    "ValidatingStrategy",
    "apply_policy",
    "check_update",
    "load_shared",
    "make_client_app",
    "require_flwr",
    "run_fleet_simulation",
    "shared_state",
]

__getattr__ = lazy_getattr(
    __name__,
    {
        "AdjustedUpdate": "taste_cl.adapters.flower.fleet",
        "AggregationPolicy": "taste_cl.adapters.flower.fleet",
        "DroppedUpdate": "taste_cl.adapters.flower.fleet",
        "FleetResult": "taste_cl.adapters.flower.fleet",
        "InvalidUpdateError": "taste_cl.adapters.flower.fleet",
        "RoundStats": "taste_cl.adapters.flower.fleet",
        "ValidatingStrategy": "taste_cl.adapters.flower.fleet",
        "apply_policy": "taste_cl.adapters.flower.fleet",
        "check_update": "taste_cl.adapters.flower.fleet",
        "load_shared": "taste_cl.adapters.flower.fleet",
        "make_client_app": "taste_cl.adapters.flower.fleet",
        "require_flwr": "taste_cl.adapters.flower.fleet",
        "run_fleet_simulation": "taste_cl.adapters.flower.fleet",
        "shared_state": "taste_cl.adapters.flower.fleet",
    },
)

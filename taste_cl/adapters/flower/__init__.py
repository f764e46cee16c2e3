"""Fleet personalization on Flower: devices share what generalizes, keep what is personal.

- :mod:`.fleet`: shared/personal state, the ClientApp, the validating aggregation, the simulation;
- :mod:`.app`: the digits fleet as one Flower App (the same apps for simulation and deployment);
- :mod:`.secagg`: the fleet under SecAgg+ secure aggregation;
- :mod:`.deployment`: a real SuperLink and SuperNodes as processes on loopback;
- :mod:`.tls`: the run's TLS certificates and SuperNode authentication keys;
- :mod:`.updates`: what travels (the shared/personal split, update checks), numpy only;
- :mod:`.device_client`, :mod:`.device_data`, :mod:`.device_server`: devices that train
  the exported artifacts without torch (the ClientApp, its data, the server's export).

The device ClientApp imports this package without torch: its names are listed once, in
``__init__.pyi``, and each loads its module on first use (``lazy_loader``).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)

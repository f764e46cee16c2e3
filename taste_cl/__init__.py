"""taste_cl: continual-learning personalization for PyTorch models on edge devices.

The public API is flat. Its names are listed once, in ``__init__.pyi`` (which type checkers
read), and each is imported on first use (``lazy_loader``), so ``import taste_cl`` needs no
torch: the torch-free device runtime (``taste_cl.adapters.onnxruntime.runtime``) imports this
package on a device without it. Adapters (Avalanche, ONNX Runtime, Flower) live in
``taste_cl.adapters`` and are never imported from here.
"""

import lazy_loader

__version__ = "0.1.0"

__getattr__, __dir__, _names = lazy_loader.attach_stub(__name__, __file__)
__all__ = sorted([*_names, "__version__"])

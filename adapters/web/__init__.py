"""The browser: make an ONNX Runtime artifact folder loadable by ONNX Runtime Web."""

from taste_cl._lazy import lazy_getattr

__all__ = [
    "WEB_FORMAT",
    "WEB_MANIFEST",
    "WEB_OPTIMIZER_MODEL",
    "WebCompatibilityError",
    "add_web_artifacts",
    "check_strict_shapes",
    "make_web_compatible",
]

__getattr__ = lazy_getattr(
    __name__,
    {
        "WEB_FORMAT": "taste_cl.adapters.web.compat",
        "WEB_MANIFEST": "taste_cl.adapters.web.compat",
        "WEB_OPTIMIZER_MODEL": "taste_cl.adapters.web.compat",
        "WebCompatibilityError": "taste_cl.adapters.web.compat",
        "add_web_artifacts": "taste_cl.adapters.web.compat",
        "check_strict_shapes": "taste_cl.adapters.web.compat",
        "make_web_compatible": "taste_cl.adapters.web.compat",
    },
)

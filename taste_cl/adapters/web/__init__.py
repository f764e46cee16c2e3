"""The browser: make an ONNX Runtime artifact folder loadable by ONNX Runtime Web."""

from taste_cl.adapters.web.compat import (
    WEB_FORMAT,
    WEB_MANIFEST,
    WEB_OPTIMIZER_MODEL,
    WebCompatibilityError,
    add_web_artifacts,
    check_strict_shapes,
    make_web_compatible,
)

__all__ = [
    "WEB_FORMAT",
    "WEB_MANIFEST",
    "WEB_OPTIMIZER_MODEL",
    "WebCompatibilityError",
    "add_web_artifacts",
    "check_strict_shapes",
    "make_web_compatible",
]

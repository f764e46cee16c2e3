"""A learner's state on disk: the checkpoint format and the validate-then-apply restore.

- :mod:`.checkpoint`: JSON header plus safetensors buffers, no pickle; :mod:`.files`: atomic writes (no torch);
- :mod:`.restore`: check a decoded state against the live learner, then apply all of it or nothing.
"""

from taste_cl._lazy import lazy_getattr

__all__ = [
    "CHECKPOINT_FILE",
    "CheckpointLimits",
    "atomic_write_bytes",
    "decode_state",
    "encode_state",
    "read_checkpoint",
    "write_checkpoint",
]

__getattr__ = lazy_getattr(
    __name__,
    {
        "CHECKPOINT_FILE": "taste_cl.state.checkpoint",
        "CheckpointLimits": "taste_cl.state.checkpoint",
        "atomic_write_bytes": "taste_cl.state.files",
        "decode_state": "taste_cl.state.checkpoint",
        "encode_state": "taste_cl.state.checkpoint",
        "read_checkpoint": "taste_cl.state.checkpoint",
        "write_checkpoint": "taste_cl.state.checkpoint",
    },
)

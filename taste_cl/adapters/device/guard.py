"""The device update guard as an artifact folder sets it up: :func:`guard_from_manifest`.

The guard itself (:class:`~taste_cl.guards.device.DeviceUpdateGuard`) lives with the other
guards, below every learner and engine; this module reads a device folder's manifest for it:
the update-size history a saved folder kept, and whether the export's parity gate checked
generated rows (then the first steps are all measured). No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from taste_cl.adapters.device.artifacts import MANIFEST_FILE, PARITY_ROWS
from taste_cl.exceptions import ArtifactError
from taste_cl.guards.device import DeviceUpdateGuard

__all__ = ["GENERATED_ROWS_PROTECTED", "guard_from_manifest"]

GENERATED_ROWS_PROTECTED = 20
"""Steps the device guard measures from the start when the export's parity gate checked generated rows."""


def guard_from_manifest(manifest: Mapping[str, Any]) -> DeviceUpdateGuard:
    """A device learner's guard: the update-size history a saved folder kept (``"guard"``), and every
    step of the first :data:`GENERATED_ROWS_PROTECTED` measured when the export's gate checked generated
    rows (``parity.rows``). :class:`~taste_cl.exceptions.ArtifactError` names a bad value."""
    parity = manifest.get("parity")
    rows = parity.get("rows", "given") if isinstance(parity, Mapping) else "given"
    if rows not in PARITY_ROWS:
        raise ArtifactError(f"{MANIFEST_FILE}: `parity.rows == {rows!r}`, must be one of {list(PARITY_ROWS)}")
    guard = DeviceUpdateGuard(protect_first=GENERATED_ROWS_PROTECTED if rows == "generated" else 0)
    if manifest.get("guard") is not None:
        try:
            guard.load_state_dict(manifest["guard"], where=f"{MANIFEST_FILE}'s guard")
        except ValueError as error:
            raise ArtifactError(str(error)) from None
    return guard

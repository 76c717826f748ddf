"""What the configuration dataclasses share: abstract bases and their checks.

Defined once in :mod:`secondorder.shampoo.named_configs` (``so.Shampoo`` takes some of
these configs natively); re-exported here for the drop-in's own dataclasses.
"""

from __future__ import annotations

from ...shampoo.named_configs import Abstract, check_bool, check_in, check_int

__all__ = ["Abstract", "check_bool", "check_in", "check_int"]

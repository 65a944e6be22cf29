"""Hook specifications of radixd.

Each hook is documented with its arguments. Factory hooks return objects that the engine
calls directly on its hot paths; lifecycle hooks are called once per event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixd.plugins import hookspec

if TYPE_CHECKING:
    from radixd.core.policy import SchedulePolicy


# ---------------------------------------------------------------------------------------------
# Scheduling
# ---------------------------------------------------------------------------------------------


@hookspec
def radixd_schedule_policies() -> dict[str, type[SchedulePolicy]]:
    """Return the scheduling policies this plugin provides, by name.

    A policy class is instantiated once per engine with the engine's ``EngineConfig`` and
    must implement :class:`radixd.core.policy.SchedulePolicy`. Names must be unique across
    plugins; the engine refuses a duplicate name at start-up.
    """

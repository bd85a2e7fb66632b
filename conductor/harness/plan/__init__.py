"""Capacity planning: the fewest prefill and decode instances that meet the SLOs, found by replaying the
traffic through the simulator (:mod:`.search` the search, :mod:`.forecast` the growth to plan for,
:mod:`.planner` the command, :mod:`.serve` the planner process)."""

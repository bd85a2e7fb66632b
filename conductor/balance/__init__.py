"""KVCache balance: hot prefixes replicated to where there is compute, cold ones demoted.

- :mod:`.planner`: pure planning (heat, triggers, commands).
- :mod:`.worker`: ``conductor balance``, which reads ``requests`` and the view and
  publishes the planner's commands on ``kv-commands``.
"""

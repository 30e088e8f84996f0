"""The planner: layout types, memory, collectives and step time per rank. Pure: no torch, no machine probes
(machine facts arrive as data)."""

"""Parsers, analyzers and the report, in three layers that import downwards only. Never imports torch.

- analysis.parsers: sources -> tables (one module per artefact format; what kind of file this is, `recognize`;
  a run directory's files loaded into tables, `runs`);
- analysis.analyzers: pure functions of tables (steps, memory, time breakdown, collectives, nccl-tests ceilings,
  timers, curves, the doctor);
- analysis.report: the report's data, sections, renderers and figures; the only layer that draws;
- analysis.table: the one table type, shared by all three. `python -m analysis` is the command line.
"""

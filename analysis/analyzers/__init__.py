"""Analyzers: pure functions from parser tables to documented tables; nothing here reads a file or draws.

The middle layer of analysis/: analysis.parsers (sources -> tables) below, analysis.report (data, sections,
render, plots) above. Analyzers import parsers and analysis.table, never the report.

- steps: each source's step records as one per-step table, the warm-up rule, step statistics and MFU, and where
  a framework log holds more than one run (`run_boundaries`);
- memory: the peak per rank against the planner's prediction and the device;
- breakdown: where the time went per rank (compute, exposed communication, other, idle; overlap), exposed time
  per collective, stragglers, the kernel diff, `nsys stats` totals;
- collective_calls: every collective call with its size and bus bandwidth, per collective type against the
  nccl-tests ceiling, and the counts against what the layout needs;
- ceilings: the nccl-tests sweeps: the one busbw-vs-size curve, the large-message ceilings, busbw at a size;
- timers: Megatron's and DeepSpeed's own timers;
- trace_analysis (HTA's definitions on Kineto tables), collectives (how a call is counted and sized), curves
  (training curves), comm_tables (nccl-tests rows and NCCL transports as listed), doctor (named pitfalls),
  run_layout (a run's layout and training settings as the report states them).
"""

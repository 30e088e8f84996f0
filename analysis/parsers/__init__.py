"""Sources -> tables: one module per artefact format, each returning an `analysis.table.Table`; what kind of file
this is (`recognize`), a run directory's files loaded into tables (`runs`, our commbench results through
`commbench`), the kernel names both trace parsers classify (`gpu_kernels`), and an nsys timeline as a Kineto-shaped
table (`nsys_adapter`). Parsers never import analysis.analyzers or analysis.report."""

"""One module per artefact format; each returns an `analysis.table.Table`."""

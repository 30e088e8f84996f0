"""Torch programs of the driver, not rank code: the checkpoint check and DeepSpeed's converter under it
(untrusted), Megatron's indexed datasets checked and built (indexed), and export. The commands (and the driver's
preflight in launch/run and launch/data) start them as processes, `python -m launch.torchtools.NAME`, and never
import them; rank code imports the same modules for the same work on a rank (the weights-only guard, the indexed
token stream, the model's transformers config in hf). export is the one that reaches rank code: each backend's own
`export_hf_state`, by name through the backend registry."""

"""Example models for tvmfuse: factories returning ``(nn.Module, example_inputs)``."""

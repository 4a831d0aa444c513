"""Target engines: the interface the decode loop drives (``base``), our numpy/GGUF transformer with
its compiled kernels, the PyTorch engine, and finding and loading the models they run."""

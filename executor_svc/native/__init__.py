"""Our C++ CPU kernels: sources (csrc/, the pagoda-kernels distribution), their variants and loading.

Built ahead of time (``make install``, the executor image), never at serve
time: ``variants`` says which builds exist and which a CPU runs, ``loader``
loads one as ``torch.ops.pagoda``, ``check`` reports what is installed, and
``active`` names the paths an executor runs.
"""

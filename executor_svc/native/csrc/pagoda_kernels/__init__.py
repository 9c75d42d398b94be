"""Built C++ kernels of Pagoda's executor: one library per CPU variant and manifest.json.

Not imported for code: executor_svc.native.loader reads the manifest and
loads one library with ``torch.ops.load_library`` (the ops are then
``torch.ops.pagoda.*``).
"""

"""Our C++ CPU code (the paged decode kernel and the fused elementwise ops) and its JIT build."""

"""The device side: the executor (the one door to the device), the model runner and its step arrays and
shapes, a draft model's runner (speculative decoding), the KV pool and its sizing, the compilation cache, the mesh,
several hosts."""

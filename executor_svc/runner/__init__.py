"""A step on the device: the model runner (a step plan in, tokens out), its batch tensors, the draft model, the
device and dtypes."""

"""What the LoRA side of the executor refuses with."""


class LoraAdapterError(ValueError):
    """An adapter this model cannot serve (a missing or bad file, an option, a module, a rank or a shape); the
    message names the problem. Nothing was registered or changed."""


class LoraRegistryError(ValueError):
    """A registry call that does not fit its state: an unknown name, a name already taken, or removing an
    adapter that running sequences use."""

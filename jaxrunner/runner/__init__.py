"""The ModelRunner and what it owns: the weights on the devices, the compiled executables and their cache, the compile guard."""

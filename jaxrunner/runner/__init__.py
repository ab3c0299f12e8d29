"""The ModelRunner and the pieces it is built from: the run plan (resolved engine arguments,
memory plan, model layout), the step programs, the compiler and executable cache, the weights on
the devices, the compile guard."""

"""The sm_90 (Hopper) Gluon kernels of attention: the forward (``forward``) and the backward (``backward``), which the
launchers of ``ops.attention`` import on sm_90 GPUs only (``configs.gluon_device``)."""

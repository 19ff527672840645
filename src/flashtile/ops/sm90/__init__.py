"""The sm_90 (Hopper) Gluon kernels of attention: the forward (``forward``) and the backward (``backward``), which the
dispatcher (``flashtile._backend``) imports on sm_90 GPUs only (``gluon_refusal``)."""

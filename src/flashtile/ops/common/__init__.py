"""What the kernels and launchers of several operations (attention forward and backward, decode, the sm_90 Gluon
kernels) share: each operation imports from here, never from another operation's folder."""

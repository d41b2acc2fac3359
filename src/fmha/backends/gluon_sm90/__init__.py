"""The Hopper (sm_90) kernels in Gluon: a warp-specialised, TMA-fed, wgmma-pipelined forward."""

"""The fused kernels: the engine's tiles as Pallas programs, one package of backends.

Its modules, from the bottom:

- ``backend``: what a backend is (its compiler parameters, how its programs add up); one module
  each for ``triton`` (GPUs), ``mosaic_tpu`` (TPUs) and the ``interpreter`` (anywhere: the
  tests' oracle, and the TPU simulator). A new backend (Mosaic GPU) is one more module there,
  and a line of ``calls.PLATFORMS``. Below them ``values`` (a kernel's values not arrays yet)
  and ``rewrites`` (what a backend lowers no primitive for, computed by what it lowers).
- ``positions``, ``scatters``, ``reads``: reading the arrays a call closes over inside a
  kernel, each at the indices it uses (rule sets of :mod:`jax_sdpa._jaxpr`).
- ``programs``: the programs every backend runs, written once over named refs: the forward
  pass, the queries' gradients, the keys' and values' gradients.
- ``schedule``, ``atomics``, ``warp_specialized``, ``mosaic_gpu``: the Mosaic GPU kernels
  (Hopper): which blocks a program sweeps, the gradients added into memory at points, the
  producer and consumers, the forward and backward kernels.
- ``calls``: the programs as functions of arrays: block specs, padding, the backend chosen by
  the platform the program is lowered for.
"""

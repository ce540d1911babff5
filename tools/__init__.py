"""Developer tools, run from a checkout (`python -m tools.<name>`); not installed with jserve.

- check_lowering: export every Pallas kernel for tpu and cuda (the CI gate in tests/test_kernels.py).
- load_memory: peak host memory while a checkpoint loads onto a mesh (docs/deploy-tpu-vm.md).
- train_demo: train the bundled demo checkpoint, checkpoints/demo (checkpoints/README.md).
"""

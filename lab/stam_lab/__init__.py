"""The lab part of STAM (the project ``stam-lab``): evaluation (:mod:`stam_lab.eval`), training of the write modules'
adapters (:mod:`stam_lab.training`) and their commands (:mod:`stam_lab.cli`: ``stam eval``, ``stam train``, ``stam
deletion calibrate|label``, registered into the product's ``stam`` command through entry points).

It uses the product (``stam``, ``schemas``); the product never imports it, and a deployment installs the product
alone (``pip install .``). The benchmarks (``benchmarks/``, run from a checkout) are on this side too.
"""

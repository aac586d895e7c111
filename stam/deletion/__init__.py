"""The conservative deletion gate (paper section 3.5; issue 16), being built.

Here so far: endurance labels from codes (:mod:`stam.deletion.labels`), the conformal calibration of the
gate's threshold with its diagnostics (:mod:`stam.deletion.calibrate`) and the candidates it may score
(:mod:`stam.deletion.candidates`). Not yet: the language-model judge's
labels, the deletion scorer, candidates and deletion as a transition. Until those exist nothing is deleted: a
DELETE proposal of the updater is recorded and never acted on.
"""

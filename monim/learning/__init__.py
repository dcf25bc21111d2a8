"""Learning (layer 5): what to memorize (the adaptive threshold, the policies, merging), the daily
calibration and the parametric learners. Imports the layers below; never monim.evaluation."""

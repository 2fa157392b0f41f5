"""Offline work: Sequoia's acceptance-vector calibration, SpecDec++ training data, training and tuning."""

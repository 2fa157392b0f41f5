"""Pure functions between forward passes: the draft tree, sampling transforms, verification rules, Sequoia's DP."""

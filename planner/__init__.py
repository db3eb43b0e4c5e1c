"""The cluster planner (`python plan.py`): cost.py prices a layout, calibrate.py checks it against
Neuron's published trn1 figures and fits its three constants, report.py prints the plan."""

"""The papers' recipes, one YAML file per published run, installed as ``hpcdl.recipes``.

Package data only: ``hpcdl.train.config.resolve_recipe`` finds a file here by its name.
"""

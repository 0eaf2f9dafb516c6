"""Engine integrations: the only code that knows another project's internals.

Each engine has one subpackage; nothing else in wsd imports them, and
``import wsd`` never imports an engine.
"""

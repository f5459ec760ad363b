"""The command line: parsers generated from the configs, thin command entries and the error -> exit-code map."""

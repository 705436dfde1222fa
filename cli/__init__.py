"""The `meshrl` command line."""

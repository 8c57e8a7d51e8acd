"""The `meshagent` command line."""

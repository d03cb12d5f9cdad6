"""matplotlib is optional: plots are drawn where it is installed and skipped with a note where it is not (a
bare GPU machine); the numbers they show are always written as JSON / Markdown too."""


def pyplot(what: str):
    """matplotlib.pyplot on the Agg backend, or None after a one-line note that `what` is not drawn."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: {what} not drawn", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

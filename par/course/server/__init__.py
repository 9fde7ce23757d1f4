"""The course on a GPU server: an offline install for a node without internet (`wheelhouse`), and the one command that checks a GPU server and records its run (`gpu_check`)."""

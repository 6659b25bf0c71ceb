"""`python -m shoal.run ...`: the same launcher as `shoal run ...`."""

from shoal.elastic.launcher import main

if __name__ == "__main__":
    main()

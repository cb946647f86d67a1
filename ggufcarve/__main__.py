from ggufcarve.cli import main

main()

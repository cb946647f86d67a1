from ggufcarve.console import main

main()

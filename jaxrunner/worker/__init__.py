"""The model worker (SGLang's TpModelWorker): the one door from the scheduler to the device."""
